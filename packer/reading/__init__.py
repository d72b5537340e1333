"""The read path's datasets: a packed dataset's samples decoded (read-time resize, crop, augmentation and fields)
into tensors and batch memory, and the image folder read the same way.
"""
