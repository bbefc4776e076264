"""Tests of phasesched.experiments and phasesched.report."""
