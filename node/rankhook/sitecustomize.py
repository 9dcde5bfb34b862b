"""Python loads this at start-up in every process of a `fab` launch: the launch puts this folder
first on PYTHONPATH. In torchrun's workers it starts the rank monitor (gpu_cluster_rank_monitor.py);
then it hands over to the interpreter's own sitecustomize, if there is one (Debian and Ubuntu ship
one), so that nothing the user relies on is lost.
"""

import os
import sys


def _start_rank_monitor() -> None:
    if os.environ.get("RANK") is None:
        return  # torchrun's agent, or a process started outside a launch
    try:
        import gpu_cluster_rank_monitor

        gpu_cluster_rank_monitor.start()  # nothing where the launch set no progress folder
    except Exception as exc:  # the job runs on without its monitor rather than not at all
        print(f"gpu-cluster: the rank monitor did not start ({type(exc).__name__}: {exc})", file=sys.stderr)


def _chain_to_the_next_sitecustomize() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    module = sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401  (the interpreter's own, found further down the path)
    except ImportError:
        if module is not None:
            sys.modules["sitecustomize"] = module
    finally:
        sys.path[:] = saved


_start_rank_monitor()
_chain_to_the_next_sitecustomize()
