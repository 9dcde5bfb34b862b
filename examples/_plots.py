"""Plots for the examples: matplotlib when the node has it, a clear sentence when it does not."""

NO_MATPLOTLIB = "matplotlib is not installed here: no plot (the JSON has every figure)"


def pyplot():
    """matplotlib.pyplot drawing to files (no display needed), or None where matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
