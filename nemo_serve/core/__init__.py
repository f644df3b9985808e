"""The multi-process server: one engine core process, K front-end processes, one supervisor.

  supervisor.py       starts the core, then the front ends; restarts a dead front end; exits
                      non-zero when the core dies; SIGTERM drains every front end, then the core
  engine_core.py      the core process: the Engine driven by a busy loop; control and audio in,
                      StreamUpdates out (no network, no JSON, no text)
  client.py           EngineClient: the Engine's network-side API inside a front end
  frontend_process.py a front-end process: the same FastAPI app, on a SO_REUSEPORT socket
  shared.py           shared memory: per-slot audio rings, the slot table, the core's state
  messages.py         control and result messages (msgspec structs)
"""
