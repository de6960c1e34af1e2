"""Pure scheduling policies: no I/O, no kernel, no torch. Each function names the paper and rule it implements."""
