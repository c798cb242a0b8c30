"""What both product packages (the gateway and the operator) stand on: the schema language
their typed configs are declared in (`schema`), and the one reader of SGLang's /metrics and
the names of the metrics kvfleet reads (`sglang_metrics`). It imports none of ours."""
