"""Unit tests of zerodp.checkpoint (in-process, no process group unless a test makes one)."""
