"""Parquet schemas, writers and dataset reading."""
