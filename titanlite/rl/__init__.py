"""GRPO: group relative policy optimisation with verifiable rewards. Each prompt's completions are scored by the
reward functions, each reward is compared with its group's (grpo_loss.group_advantages), and the policy is trained on
the clipped importance-weighted advantages with an optional k3 KL penalty to a reference (grpo_loss), with TRL's
meanings throughout; docs/grpo.md gives the math."""
