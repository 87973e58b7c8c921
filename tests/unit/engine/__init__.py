"""Unit tests of zerodp.engine (in-process, no process group unless a test makes one)."""
