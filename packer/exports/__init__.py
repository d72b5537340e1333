"""A packed dataset written back out: as an image folder with its table (:mod:`.folder`), or as a Hugging Face
``datasets.Dataset`` (:mod:`.hf`).
"""
