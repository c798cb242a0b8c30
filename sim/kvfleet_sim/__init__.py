"""kvfleet_sim: CPU stand-ins for what these machines lack.

The SGLang-compatible engine (catalogue, cost model, radix cache, scheduler, HTTP server),
the fleet discrete-event simulator, and (later) the local cluster. Nothing here is the
product: the operator and gateway must work unchanged against real SGLang.
"""
