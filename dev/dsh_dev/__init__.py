"""dsh-pipeline's development package: the local stack, the chaos campaign, the synthetic
generator and the commands ``broker``, ``demo``, ``chaos`` and ``bench`` (dev/README.md)."""
