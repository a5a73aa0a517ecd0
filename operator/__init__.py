"""SITS operator: reconciles SitsDeployment resources into GPU workloads with canary rollouts."""
