"""Shipped model profiles (JSON data read by policies.model.load_profile); see README.md."""
