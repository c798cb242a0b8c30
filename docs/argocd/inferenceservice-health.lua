-- Argo CD health check for kvfleet.dev/InferenceService (argocd-cm:
-- resource.customizations.health.kvfleet.dev_InferenceService). Tested against status
-- objects the operator writes: tests/integration/test_operator_in_cluster.py.
--   Progressing  the operator has not observed this generation yet, or it is rolling out
--                or scaling, or no replica is ready yet
--   Degraded     an invalid spec, replicas failing (crash loops, failed probes), or
--                replicas no node has room for (Unschedulable)
--   Suspended    scaled to zero on purpose
--   Healthy      serving, every replica current and ready
local hs = {}
local status = obj.status
if status == nil or status.conditions == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvfleet operator to report a status"
  return hs
end
local generation = obj.metadata.generation
if generation ~= nil and (status.observedGeneration == nil or status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the kvfleet operator to observe generation " .. generation
  return hs
end
local ready, progressing, degraded
for _, c in ipairs(status.conditions) do
  if c.type == "Ready" then ready = c end
  if c.type == "Progressing" then progressing = c end
  if c.type == "Degraded" then degraded = c end
end
if degraded ~= nil and degraded.status == "True" then
  hs.status = "Degraded"
  hs.message = degraded.message or degraded.reason
  return hs
end
if ready ~= nil and ready.status == "False" and ready.reason == "ScaledToZero" then
  hs.status = "Suspended"
  hs.message = ready.message or "scaled to zero"
  return hs
end
if ready ~= nil and ready.status == "True" then
  if progressing ~= nil and progressing.status == "True" then
    hs.status = "Progressing"
    hs.message = progressing.message or progressing.reason
    return hs
  end
  hs.status = "Healthy"
  hs.message = ready.message or "serving"
  return hs
end
hs.status = "Progressing"
if ready ~= nil then
  hs.message = ready.message or ready.reason
else
  hs.message = "Waiting for the Ready condition"
end
return hs
