"""What the tests share and are not tests themselves: the fake worker and the scheduler
harness, the gateway's helpers, the stack launcher, the model runner's helpers, the Triton
cases, media and a local media server, the stand-in Hugging Face Hub, the schemathesis hooks.
Imported as `tests.support.<module>` (bench/stack/sim_worker.py imports the fake worker too)."""
