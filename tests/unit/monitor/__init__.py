"""Unit tests of zerodp.monitor (in-process, no process group unless a test makes one)."""
