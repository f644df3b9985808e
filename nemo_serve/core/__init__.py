"""The multi-process server: one engine core process, K front-end processes, one supervisor.

  supervisor.py       starts the core, then the front ends; restarts a dead front end; exits
                      non-zero when the core dies; SIGTERM drains every front end, then the core
  engine_core.py      EngineCore: the Engine behind the slot table, no transport; calls in
                      (open, wrote, finish, abort), StreamUpdates out of step()
  core_proc.py        the core process: EngineCore in a ZMQ busy loop (no network, no JSON, no text)
  inproc.py           LocalEngine: the same EngineCore in this process (tests, --selftest, benchmarks)
  client.py           EngineClient: the Engine's network-side API inside a front end
  frontend_process.py a front-end process: the same FastAPI app, on a SO_REUSEPORT socket
  shared.py           shared memory: per-slot audio rings, the slot table, the core's state
  messages.py         control and result messages (msgspec structs)
"""
