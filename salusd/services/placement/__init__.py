"""Sky Computing layer placement: profiles, allocators (even, sky, optimal MILP), pipeline split."""
