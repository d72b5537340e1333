"""What the tests share, one home each: ``packed`` (the stores conftest packs once, reference pixels, polling),
``readers`` (the formats read without packer, and the checks against the source), ``fields`` (datasets with every
kind of field), ``remote`` (local HTTP and S3 servers, a fault proxy), ``processes`` (packer and torchrun in other
processes, one-line error checks)."""
