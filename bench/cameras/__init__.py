"""Benchmarks of images and camera streams: cameras.py (with camera_metrics.py,
camera_report.py, camera_uploads.py) and cameras_compare.py, images.py against
static_generate_images.py, frame_path.py, the encoder service (encoder_budget.py,
encoder_scaling.py, encoder_fleet.py), and camera_limits.py (the physical limit)."""
