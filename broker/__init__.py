"""FleetBroker's control plane: state, scheduling loop, actuator, API, CLI, simulator, runtime."""

__version__ = "0.1.0"
