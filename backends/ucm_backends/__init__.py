"""UCM's built-in tiers. Each module registers its tier through the same ``register_tiers``
plugin hook that third-party packages use."""
