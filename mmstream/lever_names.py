"""The levers a bench run can switch off (``mmstream bench --no-<lever>``), by name.

Kept apart with no imports: the CLI builds its flags from it at start-up without loading the
bench, and ``mmstream.levers`` (what switching one off means) and the bench both read it.
``grouping`` off batches text in arrival order (FIFO, as a generic server) instead of by length;
``placement`` off sends every part through its encode topic (no encoder in the router's process).
"""

LEVERS = ("routing", "cache", "admission", "lanes", "grouping", "placement")
