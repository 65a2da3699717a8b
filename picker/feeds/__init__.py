"""What feeds the decision core from outside: scrapes, KV events, peers, discovery, remote tokenization.

Each module here writes the core's state only through a method of the core, and names the
fields it writes in its docstring (one writer per field)."""
