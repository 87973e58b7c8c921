"""Unit tests of zerodp.comm (in-process, no process group unless a test makes one)."""
