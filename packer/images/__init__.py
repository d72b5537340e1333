"""Image bytes and pixels, shared by both paths: decoding and encoding under a pixel limit, the offline
transforms, the OpenCV resampler, and masks (class indices, never smoothed).
"""
