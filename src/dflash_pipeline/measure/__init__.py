"""Measurement shared by train and evaluate: teacher-forced scoring, typed records, end-to-end runs."""
