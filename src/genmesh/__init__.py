"""genmesh: a serving mesh over NATS for the native token-in/token-out generate APIs."""

__version__ = "0.1.0"
