"""The local provider: nodes as SSH servers on loopback addresses of this machine."""
