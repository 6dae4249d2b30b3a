"""The evaluate wing: the teacher-forced scorer and the `evaluate` stage."""
