"""Ready-made reward functions, referenced from a config as ``asyncgrpo.rewards.<module>:<fn>``.

Each module imports its heavy dependencies lazily, so this package costs nothing to import.
"""
