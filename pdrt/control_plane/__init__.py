"""The control plane: the controller process, its registry, and the link every other process keeps to it."""
