"""Hold the machine's 1-minute load average near a target with CPU burners.

Every 15 s: one ``while True: pass`` process more for every 2 units the load average is
under ``target``, one fewer for every 2 over (at most 10). Each reading is appended to
``log``; the script stops, with its burners, when ``<log>.stop`` exists (one left by an
earlier run is removed at the start). Used to time
``.ci/run`` on a loaded machine (docs/benchmarks.md#test-suite-time).

    python3 benchmarks/hold_load.py 8 /tmp/load.log &
    ... the run to time ...
    touch /tmp/load.log.stop
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

MAX_BURNERS = 10
PERIOD_S = 15


def main(target: float, log_path: str) -> None:
    burners: list[subprocess.Popen] = []
    if os.path.exists(log_path + ".stop"):  # an earlier run's: this run would hold no load
        os.remove(log_path + ".stop")
    with open(log_path, "a", buffering=1) as log:
        try:
            while not os.path.exists(log_path + ".stop"):
                load1 = os.getloadavg()[0]
                want = max(0, min(MAX_BURNERS, len(burners) + round((target - load1) / 2)))
                while len(burners) < want:
                    burners.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
                while len(burners) > want:
                    burners.pop().kill()
                log.write(f"{time.strftime('%H:%M:%S')} load1={load1:.2f} burners={len(burners)}\n")
                time.sleep(PERIOD_S)
        finally:
            for burner in burners:
                burner.kill()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=float, help="the 1-minute load average to hold")
    parser.add_argument("log", help="the log file; touch LOG.stop to end the run")
    args = parser.parse_args()
    main(args.target, args.log)
