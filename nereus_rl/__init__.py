"""nereus_rl: elastic RL post-training on top of nereus_comm."""

__version__ = "0.1.0"
