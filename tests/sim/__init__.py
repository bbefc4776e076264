"""Tests of phasesched.sim."""
