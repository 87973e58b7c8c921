"""Unit tests of zerodp.shard (in-process, no process group unless a test makes one)."""
