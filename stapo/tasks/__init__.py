"""What the policy is asked and how it is graded: the benchmarks and training sets (data), the generated tasks
(synthetic, word_problems), the prompt, gold-answer checks, ``\\boxed{}`` extraction, the math-verify grader and the
training rewards."""
