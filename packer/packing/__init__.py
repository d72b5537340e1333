"""The pack path: ``pack()``'s arguments, the plan, DEST's preparation, lock and journal, the conversion in worker
processes, torchrun ranks and the upload to a URL, driven top-down by :mod:`.driver`.
"""
