"""`ninfer-rt serve`: OpenAI-compatible HTTP server over the Engine (see app.py, scheduler.py)."""
from .app import ServerState, create_app
from .scheduler import Scheduler, SchedulerConfig

__all__ = ["Scheduler", "SchedulerConfig", "ServerState", "create_app"]
