"""Getting models onto a machine that reaches only a package index."""
