"""What ``packer pack`` reads: image folders (ImageFolder semantics), annotation tables, datasets packer
packed, WebDataset shards other tools wrote, and Hugging Face datasets; :func:`detect.open_source` tells them apart.
"""
