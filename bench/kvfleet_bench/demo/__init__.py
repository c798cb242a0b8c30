"""`kvfleet demo`: the live stack, the local cluster path, and the fleet simulator, shown live."""
