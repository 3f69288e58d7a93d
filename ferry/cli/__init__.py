"""Command line: thin wrappers that parse, call one library function, and print."""
