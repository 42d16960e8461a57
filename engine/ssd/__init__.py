"""Saguaro SSD: speculative speculative decoding on two devices (ALGORITHMS.md §4).

The draft runs in its own worker process (its own cores or GPU) and, while the target verifies
round T, fills a speculation cache with the next speculation for every likely outcome of round T.
Entry point: `engine.ssd.ssd_decoding.SSDEngine`.
"""
