"""dtrain: decentralized DiLoCo-style training over unreliable networks."""

__version__ = "0.1.0"
