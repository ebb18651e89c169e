"""One part measured in process, no stack: kernels (kernels.py, cpu_attention.py,
sampling.py, with device_timing.py), model steps against the roofline (roofline.py,
mixed_step.py, kernel_count.py), the vision tower (vision_tower.py), and the scheduler's and
the worker's bookkeeping (scheduler_step.py, event_publish.py)."""
