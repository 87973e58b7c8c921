"""Unit tests of zerodp.config (in-process, no process group unless a test makes one)."""
