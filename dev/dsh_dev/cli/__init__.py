"""The commands this package adds to ``dsh-pipeline`` (:mod:`.commands` lists them)."""
