"""Skills (SPEC §5.6): folders with a SKILL.md the agent reads when a task calls for one.

`catalog.py` finds and checks them and says what the agent sees; `watcher.py` follows
their folders so a change applies from the next request. The message path and the tools
use the catalog alone; only the wiring (gateway/app.py) runs the watcher."""
