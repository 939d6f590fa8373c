"""tpufab: make a Cloud TPU pod feel like one machine."""

__version__ = "0.1.0"
