"""An engine pod's preStop drain, rendered whole into the pod (`engine.drain_hook`) and run in
the SGLang container as `python3 -c SCRIPT PORT DELAY_S BOUND_S [HOST_ENV]` — the image has
python3 (3.10 or later, as SGLang requires) and no curl, so this is the standard library
only.

1. Sleeps DELAY_S: the pod leaves its Service and the gateways' pools meanwhile; a request
   routed to it before they notice is still served.
2. Polls the engine's /metrics every second until its running and queued requests
   (`sglang:num_running_reqs` + `sglang:num_queue_reqs`, all series summed) are zero.
3. Gives up BOUND_S after it started, a little before terminationGracePeriodSeconds, when
   the kubelet kills the engine anyway.

The engine is on localhost, or at the host named by the environment variable HOST_ENV (a
multi-node worker follows its group's leader, whose requests need it to the end). An engine
that cannot be reached (already gone) ends the hook at once, as does a /metrics answer
without those series: nothing left that it could wait for. A slow answer is retried.

SGLang refreshes these gauges as its scheduler logs (each prefill batch, every 40 decode
steps, every 30 s while idle): the hook may outlast the last request by up to 30 s, within
the bound. DELAY_S and BOUND_S are node seconds, as the grace period is: a node whose clock
runs fast (the local cluster's) says by how much in KVFLEET_NODE_TIME_SCALE, which scales
them; the polling follows the engine, in real time.
"""

from __future__ import annotations

import os
import sys
import time
import urllib.error
import urllib.request

SERIES = ("sglang:num_running_reqs", "sglang:num_queue_reqs")
POLL_S = 1.0
READ_TIMEOUT_S = 5.0
TIME_SCALE_ENV = "KVFLEET_NODE_TIME_SCALE"


def say(message: str) -> None:
    print(f"drain: {message}", file=sys.stderr, flush=True)


def in_flight(exposition: str) -> float | None:
    """Running plus queued requests in a Prometheus text exposition; None if it has no
    sample of either series."""
    total, seen = 0.0, False
    for line in exposition.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        brace, space = line.find("{"), line.find(" ")
        if brace != -1 and (space == -1 or brace < space):
            name, rest = line[:brace], line[line.rfind("}") + 1 :]
        else:
            name, rest = line[:space], line[space:]
        if name not in SERIES:
            continue
        try:
            total += float(rest.split()[0])
        except (IndexError, ValueError):
            continue
        seen = True
    return total if seen else None


def scrape(url: str, timeout: float) -> str | None:
    """The exposition; None when the engine is busy (a timeout); raises OSError when it
    cannot be reached and HTTPError on an error status."""
    # No proxy: a pod's HTTP(S)_PROXY must not carry a request meant for its own engine.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            return str(response.read().decode("utf-8", "replace"))
    except urllib.error.HTTPError:
        raise
    except urllib.error.URLError as exc:
        if isinstance(exc.reason, TimeoutError):
            return None
        raise OSError(str(exc.reason)) from exc
    except TimeoutError:
        return None


def drain(url: str, delay_s: float, bound_s: float) -> str:
    """Wait as the module says; what ended the wait."""
    end = time.monotonic() + bound_s
    time.sleep(max(0.0, min(delay_s, bound_s)))
    count: float | None = None
    while True:
        left = end - time.monotonic()
        if left <= 0:
            known = "an unknown number of" if count is None else f"{count:g}"
            return f"bound of {bound_s:g}s reached with {known} requests in flight"
        try:
            text = scrape(url, min(READ_TIMEOUT_S, left))
        except urllib.error.HTTPError as exc:
            return f"{url} answered {exc.code}: not waiting"
        except OSError as exc:
            return f"engine unreachable ({exc}): nothing to wait for"
        if text is not None:
            count = in_flight(text)
            if count is None:
                return f"{url} has no {' or '.join(SERIES)}: not waiting"
            if count == 0:
                return "no requests in flight"
        time.sleep(max(0.0, min(POLL_S, end - time.monotonic())))


def main(argv: list[str]) -> int:
    port, delay_s, bound_s = int(argv[0]), float(argv[1]), float(argv[2])
    host = (os.environ.get(argv[3]) if len(argv) > 3 else None) or "localhost"
    scale = float(os.environ.get(TIME_SCALE_ENV) or 1.0)
    url = f"http://{host}:{port}/metrics"
    started = time.monotonic()
    outcome = drain(url, delay_s * scale, bound_s * scale)
    say(f"{outcome} after {time.monotonic() - started:.1f}s")
    return 0  # a failed hook only adds an Event: the kubelet stops the engine regardless


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
