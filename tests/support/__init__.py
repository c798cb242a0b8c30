"""The shared test-support layer: waiting, object factories, the local cluster and the
operator, servers (simulator, gateway, Prometheus, Redis). Fixtures are re-exported by
`tests/conftest.py`; helpers are imported from here, never re-written in a test file."""
