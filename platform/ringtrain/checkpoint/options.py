"""How a store talks to S3: endpoint, part sizes, retries and listing page size.

Kept apart from the S3 backend so that naming these options never imports boto3.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

MiB = 1 << 20
# S3 rejects parts smaller than this, except the last one of an upload.
MIN_PART_SIZE = 5 * MiB


@dataclass(frozen=True)
class S3Options:
    """How a store talks to S3; the defaults suit AWS, tests shrink the sizes."""

    # None: boto3 takes the endpoint from AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL or the config file.
    endpoint_url: Optional[str] = None
    region_name: Optional[str] = None
    # Objects this large or larger are uploaded (and read back) in parts of multipart_chunksize.
    multipart_threshold: int = 64 * MiB
    multipart_chunksize: int = 16 * MiB
    # Parallel part transfers within one large object.
    max_concurrency: int = 8
    # botocore "standard" retry mode: attempts per request, including the first.
    max_attempts: int = 8
    max_pool_connections: int = 64
    # Keys per ListObjectsV2 page (S3 returns at most 1000).
    page_size: int = 1000
    # "path" for servers that do not resolve bucket subdomains; None lets botocore choose.
    addressing_style: Optional[str] = None

    def __post_init__(self) -> None:
        if self.multipart_chunksize < MIN_PART_SIZE:
            raise ValueError(f"S3Options.multipart_chunksize must be >= {MIN_PART_SIZE} bytes (S3's minimum part size)")
        if self.multipart_threshold < 1 or self.max_concurrency < 1 or self.max_attempts < 1:
            raise ValueError("S3Options.multipart_threshold, max_concurrency and max_attempts must be >= 1")
        if not 1 <= self.page_size <= 1000:
            raise ValueError("S3Options.page_size must be within 1..1000")
        if self.addressing_style not in (None, "auto", "path", "virtual"):
            raise ValueError("S3Options.addressing_style must be None, 'auto', 'path' or 'virtual'")
