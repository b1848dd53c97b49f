"""``python -m redis_session.cli ARGS``: the same as ``redis-session ARGS``."""

from .main import main

main()
