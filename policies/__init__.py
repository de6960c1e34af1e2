"""Pure scheduling policies: no I/O (except ``model.load_profile``'s shipped profiles), no kernel, no torch.

The top level is the product's path: ``levels`` (level -> DSCP -> switch queue), ``compress`` (many priorities
onto few levels), ``cutting`` (the shim's per-parameter levels and bucket pieces), ``model`` (types, cost model,
profiles), ``simulator`` (the network engine), ``execution`` (what DDP and the shim run), ``planner``
(``plan_shim``) and ``jobs`` (the agent's job order and bands). ``papers`` holds the reproductions of published
policies, one module per paper; they import the product's modules, never the reverse.
"""
